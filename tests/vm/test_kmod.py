"""The patched rxe module's build picks its packages as the archive has them (tests/vm/kmod.py)."""

from __future__ import annotations

from tests.vm.kmod import same_release

# `apt-cache madison linux-kbuild-6.1` on 28 November 2026: the security archive had moved
# linux-kbuild to 6.1.192-3 while the kernel image and headers stayed at 6.1.192-2.
MADISON = """\
linux-kbuild-6.1 |  6.1.192-3 | http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
linux-kbuild-6.1 |  6.1.176-1 | http://deb.debian.org/debian bookworm/main amd64 Packages
"""  # noqa: E501


def test_kbuild_of_the_same_upstream_release_stands_in_for_a_revision_gone() -> None:
    assert same_release(MADISON, "6.1.192-2") == "6.1.192-3"
    assert same_release(MADISON, "6.1.176-1") == "6.1.176-1"


def test_no_kbuild_of_another_release_is_taken() -> None:
    assert same_release(MADISON, "6.1.190-1") is None
    assert same_release("", "6.1.192-2") is None
