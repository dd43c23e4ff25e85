"""``python -m statereduce.speed OUT.json --model NAME [--config config.yaml]``: the speed benchmark without
Snakemake."""

import sys

from statereduce.speed.bench import main

sys.exit(main())
