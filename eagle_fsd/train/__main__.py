"""`python -m eagle_fsd.train ...` = `eagle-fsd train-head ...`."""
from eagle_fsd.train.cli import main

raise SystemExit(main())
