from tasks.prepare import main
from tasks.common import stage_main

stage_main(main, "prepare")
