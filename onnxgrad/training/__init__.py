"""Training on stock onnxruntime, built on the passes.

- :mod:`.session`: :class:`~.session.TrainingSession` (steps, evaluation, checkpoints, export, devices).
- :mod:`.artifacts`: the training, eval and accumulation models a session runs (``artifacts.build``).
- :mod:`.losses` and :mod:`.optim`: PyTorch's losses and optimizers as ONNX graphs.
- :mod:`.train_mode`: ``model.train()`` (BatchNormalization on batch statistics, Dropout active).
- :mod:`.distributed`: data parallelism (torch.distributed or MPI).
- :mod:`.torch_export`: :func:`onnxgrad.from_torch`, a torch module exported for training.
- :mod:`.torch_module`: ``TrainingSession(..., module=net)``, the module's own tensors trained in place.
"""
