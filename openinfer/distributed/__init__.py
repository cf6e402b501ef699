"""Process groups and collectives (torch.distributed): what tensor / data / expert parallel layers talk through.

Without an initialised distributed environment every group is a single rank and every collective a no-op, so
layers are written once for both cases."""
