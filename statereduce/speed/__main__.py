"""``python -m statereduce.speed OUT.json --model NAME``: the speed benchmark without Snakemake."""

import sys

from statereduce.speed.bench import main

sys.exit(main())
