"""ShapeWorld: the offline toy world (renderer, prompt grammar, toy-model pretraining).

A miniature of GenEval (Ghosh et al. 2023) whose ground truth is computable from
pixels, so alignment can be measured without any downloaded model.
"""
