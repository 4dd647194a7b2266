"""Worker (one process or under torchrun): resume like ``goat-dist train`` does (the Trainer's own resume
path), write the universal state exactly as loaded to ``<dump>/universal/``, then train on as usual
(metrics.jsonl in run.dir). tests/integration/checkpoint/test_checkpoint.py compares the dump with the
checkpoint it resumed from: fp32 masters and Adam moments must come back unchanged in the new layout.

    python resume_dump.py <dump_dir> <goat-dist train overrides...>
"""

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from goat_dist import distributed  # noqa: E402
from goat_dist.checkpoint import universal  # noqa: E402
from goat_dist.config import load_config  # noqa: E402
from goat_dist.trainer import Trainer  # noqa: E402


def main(dump: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(None, overrides))
    universal.save(trainer.engine, trainer.model, Path(dump), trainer.state.step)
    trainer.fit()
    distributed.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
