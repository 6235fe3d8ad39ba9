"""vLLM's ``vllm.general_plugins`` entry point: register this package's names by module path.

vLLM runs :func:`register` in every process at start-up, so it stays cheap: it records
module paths with vLLM's spec factory (which imports lazily, on first use of a name) and
builds no class, imports no spec, engine or kernel. It never fails the host process:
with an unsupported vLLM it logs why and still registers, so that selecting a name
fails with :class:`~triton_offload.vllm.compat.UnsupportedVLLMError`.
"""

from __future__ import annotations

from triton_offload.vllm.compat import (
    MODULE_PATH,
    SPEC_NAME,
    TIERING_SPEC_NAME,
    UnsupportedVLLMError,
    check_vllm_version,
    logger,
)


def register() -> None:
    """Register both specs with vLLM's ``OffloadingSpecFactory`` by module path.

    The connector is not registered here: vLLM's ``KVConnectorFactory`` module imports
    vLLM's whole distributed stack (about 4 s and 2,000 modules on a 2-core CPU machine,
    measured with ``python -X importtime``), too much for a hook every vLLM process runs.
    Select it with ``"kv_connector_module_path": "triton_offload.vllm"``.
    """
    try:
        check_vllm_version()
    except UnsupportedVLLMError as error:
        logger.warning("%s", error)
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    except ImportError as error:
        logger.warning(
            "triton_offload: vLLM's OffloadingSpecFactory is unavailable (%s); %s is not "
            "registered",
            error,
            SPEC_NAME,
        )
        return
    for name in (SPEC_NAME, TIERING_SPEC_NAME):
        try:
            OffloadingSpecFactory.register_spec(name, MODULE_PATH, name)
        except ValueError:
            # Already registered in this process (plugins may load more than once).
            logger.debug("%s is already registered with vLLM's OffloadingSpecFactory", name)


__all__ = ["register"]
