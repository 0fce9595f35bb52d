import pytest
import torch

# Tiny test tensors: one thread avoids OpenMP spin overhead, which on a shared 2-core box made
# small forwards 10-100x slower with two threads.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
