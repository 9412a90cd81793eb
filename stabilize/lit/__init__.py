"""Lightning glue: the module, the trainer factory, callbacks, checkpoints, typed config."""
