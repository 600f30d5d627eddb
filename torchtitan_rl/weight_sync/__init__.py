"""Trainer -> generator weights: one packed layout (`packing`), CUDA IPC handles on one host,
and the transport chosen once at start (`transport`)."""
