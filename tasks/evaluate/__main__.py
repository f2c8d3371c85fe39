from tasks.evaluate import main
from tasks.common import stage_main

stage_main(main, "evaluate")
