"""The training loop: :func:`~recsys.train.trainer.train` (what ``recsys train`` runs, in one
process or under torchrun), one step (:mod:`~recsys.train.step`), the pipelined step, mixed
precision, torch.compile of the dense part, the optimizers and their schedule, evaluation,
metrics and progress, stop signals, the best checkpoint and early stopping, and the run
directory."""
