"""The training loop's parts: the train state and step, optimizers, checkpoints and workdirs,
placement on the mesh, evaluation, metrics and logging, and starting from pretrained params."""
