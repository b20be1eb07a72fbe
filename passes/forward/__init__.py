"""Forward-graph passes: the preparation every forward model gets before autodiff
(``prepare``: inline, recover torch parameters, fold, expose dropout masks and running
statistics, type and shape inference), loss reduction, and the graph variants a training build
derives (``eval_mode``, ``params_to_inputs``, ``to_double`` for float64 oracles)."""
