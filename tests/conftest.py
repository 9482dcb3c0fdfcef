"""Suite-wide settings: tiny models run fastest single-threaded on small CI machines."""

import torch

# With two cores shared by the test process and the service subprocesses, intra-op threads only
# add contention for the tiny models used in tests.
torch.set_num_threads(1)
