from experiments.long_probes import main
from tasks.common import stage_main

stage_main(main)
