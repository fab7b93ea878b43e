"""pytest setup: no options and no environment variables. The tests run as a user's plain `python3`
process does (the reference starts no BLAS threads; icl_fast holds BLAS at one thread itself). One
shared test double: `full_disk`, a stream every write to which fails as on a full disk."""
import errno

import pytest


class FullDisk:
    """A stdout or stderr on a full disk (`> /dev/full`): every write is OSError ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


@pytest.fixture
def full_disk():
    return FullDisk()
