"""Evaluation and reporting: scoring a policy on held-out and training prompts
(``scoring``), the before/after table (``summary``), comparison grids and pages
(``compare``, ``compare_report``, with RL guidance in ``rlg``), and multi-run reports
(``plots``, ``seed_groups``)."""
