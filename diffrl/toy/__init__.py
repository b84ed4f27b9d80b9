"""The ShapeWorld toy model: pretraining (``pretrain``), preference data (``preferences``)
and the relation probe (``relation_probe``). The task itself (prompt grammar, renderer,
verifier, fidelity) is :mod:`rewards.shapeworld`.
"""
