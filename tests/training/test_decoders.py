"""The demo trains to the same losses whichever decoder reads its clips (2 CPU ranks, one epoch each)."""

import pytest

from e2e_helpers import read_history
from e2e_helpers import demo_flags, run

pytestmark = pytest.mark.slow


def test_fast_and_diffsynth_decoders_train_to_the_same_losses(tmp_path, demo_data):
    data_root, _ = demo_data
    losses = {}
    for decoder in ("fast", "diffsynth"):
        code, output = run(tmp_path, demo_flags(data_root, tmp_path / decoder, decoder=decoder, num_epochs=1,
                                                  checkpoint_steps=100))
        assert code == 0, output[-3000:]
        losses[decoder] = [[line["loss"] for line in read_history(tmp_path / decoder / "logs", rank)]
                           for rank in (0, 1)]
    assert len(losses["fast"][0]) == 6
    for rank in (0, 1):
        assert losses["fast"][rank] == pytest.approx(losses["diffsynth"][rank], rel=1e-6, abs=1e-7)
