"""The errors of tspd_vllm, under tspd's root :class:`~tspd_core.errors.TspdError`."""

from __future__ import annotations

from tspd_core.errors import TspdError


class VllmConnectorError(TspdError):
    """Root of every error this package raises."""


class LayoutError(VllmConnectorError, ValueError):
    """vLLM's KV tensors cannot be described as one tspd arena (named: which tensor, why)."""


class SettingsError(VllmConnectorError, ValueError):
    """``kv_connector_extra_config`` (or the role in ``kv_transfer_config``) is invalid."""


class TransferParamsError(VllmConnectorError, ValueError):
    """A request's ``kv_transfer_params`` (client input) are malformed."""


class ModelExportError(VllmConnectorError, RuntimeError):
    """The model could not be written out as a Hugging Face folder."""


class UnsupportedModelError(VllmConnectorError, ValueError):
    """The model's KV cache is not one group of full-attention (or MLA) layers: refused when
    the connector is built, before any request."""
