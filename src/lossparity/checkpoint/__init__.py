"""What a checkpoint holds and how it is written and read back.

- :mod:`.format`: the weights-only contents (format header, RNG states) and their validation;
- :mod:`.checkpointer`: :class:`~.checkpointer.Checkpointer`, atomic save and exact resume, one file or a
  sharded ``torch.distributed.checkpoint`` folder;
- :mod:`.safe_dcp`: sharded metadata read without running code;
- :mod:`.folder`: the ``checkpoints/`` folder of a run (ordering, fallback to the newest intact one, rotation);
- :mod:`.convert`: ``lossparity convert-checkpoint`` for files of earlier formats.

Loading never unpickles code. The trainer (:mod:`lossparity.training`) uses this package; it imports nothing
of the trainer at run time.
"""
