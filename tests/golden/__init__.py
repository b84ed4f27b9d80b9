"""Golden values: fixed-seed 2-step runs of four tiny configs whose per-step loss, reward,
KL and grad norm are committed (``*.json`` here), so that a change that moves any of them
shows up (torchtune's expected losses, torchtitan's loss files). Regenerate with
``python -m tests.golden.regenerate`` after a change that is meant to move them, and say
why in the commit."""
