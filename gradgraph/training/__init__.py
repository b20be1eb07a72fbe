"""The training build (a declared pipeline of passes), the session that runs it, its state.

- ``options``: :class:`TrainingOptions`, one object composed of per-pass option groups;
- ``build``: the training pipeline's stages and ``build_training_artifacts``;
- ``session``: :class:`TrainingSession`, running the artifacts in stock onnxruntime;
- ``parameters``: the reference-compatible :class:`TrainingParameters`;
- ``checkpoint``, ``ort_state``, ``schedules``: checkpoints, on-device state, lr schedules.
"""
