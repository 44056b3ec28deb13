"""A notebook opens in JupyterLab with nothing to save: JupyterLab writes the kernel's `language_info` and
`kernelspec` into the notebook once its kernel starts (deep-equal values change nothing), and any change marks the
tab unsaved. So the .ipynb `make setup` pairs holds what the kernel reports (its kernel_info reply, asked here of a
live kernel), and the kernelspec JupyterLab writes (name, display_name, language of the kernel's spec)."""
import pytest

nbformat = pytest.importorskip("nbformat")
jupyter_client = pytest.importorskip("jupyter_client")

from test_notebooks import tiny_repo  # noqa: F401 - the fixture
from xlab import notebook_utils as nbu


@pytest.fixture(scope="module")
def kernel_info():
    """What a python3 kernel says of itself: (language_info of its kernel_info reply, its kernelspec's fields)."""
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        kc.kernel_info()
        reply = kc.get_shell_msg(timeout=30)
        while reply["msg_type"] != "kernel_info_reply":
            reply = kc.get_shell_msg(timeout=30)
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
    spec = km.kernel_spec
    return reply["content"]["language_info"], dict(name="python3", display_name=spec.display_name,
                                                    language=spec.language)


@pytest.mark.slow
def test_a_paired_notebook_holds_what_jupyterlab_would_set(tiny_repo, kernel_info):  # noqa: F811
    language_info, kernelspec = kernel_info
    nbu.pair()
    nb = nbformat.read(tiny_repo / "05_memory.ipynb", as_version=4)
    assert nb.metadata["language_info"] == language_info
    assert nb.metadata["kernelspec"] == kernelspec
