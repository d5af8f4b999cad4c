"""Training: the loop's steps, checkpoints, the loss log and plot, validation samples."""
