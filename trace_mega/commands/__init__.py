"""The `trace-mega` commands (train, eval, demo, pretrain, plan, export, bench, SLURM launch): thin
front ends over the library, which never imports them."""
