"""The training loop and what it needs: :class:`~diffrl.training.trainer.Trainer` (one
iteration: prompts -> rollout -> rewards -> credit -> update -> sync -> log), the typed
hand-offs between its stages (``stages``), the update stage (``update``, ``passes``), the
policy and its EMAs (``policy``), prompts (``data``), the run plan (``plan``), the
accelerator and LR schedule (``setup``), checkpoints and run directories (``checkpoint``,
``run_dir``), metrics and console output (``metrics``, ``console``) and the stall watchdog
(``watchdog``). docs/ARCHITECTURE.md gives the reading order."""
