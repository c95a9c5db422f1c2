"""The fast learning check (#29): from a warm start that writes the right answer about as often as the expert's
slip, 8 steps of RL with the pass/fail reward move the policy toward the right answer, and the same steps with
the rewards shuffled within each group (same rollouts, no signal) do not (`benchmarks/learning_gain.py`; ~2 min).

The bounds come from seven pairs of runs on three warm starts (docs/benchmarks.md, "Seventh attempt"): with the
reward the answer share gained 0.093-0.137, shuffled -0.039-+0.045, reward minus shuffled 0.055-0.175. A broken
reward path (advantages of the wrong sign, rewards not reaching the batch, behaviour log-probs misaligned with the
trained tokens) leaves the reward run where the shuffled one is, and fails the first bound.
"""

from pathlib import Path

import pytest

from benchmarks.learning_gain import answer_share, reinforce, warm_start


@pytest.mark.slow  # ~2 min: `make test`'s serial pass runs it, `make check` does not
def test_rl_moves_the_policy_toward_the_right_answer_and_shuffled_rewards_do_not(tmp_path: Path) -> None:
    model = warm_start(tmp_path / "warm", seed=0)
    warm = answer_share(model)
    assert 0.3 < warm < 0.8, f"the warm start's answer share {warm:.3f} leaves RL nothing to choose between"
    reward = answer_share(reinforce(model, tmp_path, seed=1, shuffle_rewards=False))
    shuffled = answer_share(reinforce(model, tmp_path, seed=1, shuffle_rewards=True))
    figures = f"warm {warm:.3f}, reward {reward:.3f}, shuffled {shuffled:.3f}"
    assert reward - warm >= 0.06, f"RL with the reward gained too little: {figures}"
    assert reward - shuffled >= 0.03, f"the gain is not the reward's: {figures}"
