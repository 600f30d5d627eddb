import logging

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests share 2 cores with Monarch child processes; one thread avoids oversubscription."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def package_logger_restored():
    """`train.main` points the package logger at tqdm; later tests expect it as it was."""
    logger = logging.getLogger("torchtitan_rl")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved
