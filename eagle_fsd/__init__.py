"""eagle-fsd: EAGLE-2 dynamic-tree speculative decoding with fuzzy acceptance."""
