"""EAGLE-2 dynamic draft tree: pure tensor functions."""
