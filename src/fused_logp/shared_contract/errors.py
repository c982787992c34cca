"""Exceptions raised by the op and its adapters."""


class ContractInputError(ValueError):
    """An argument lies outside what the contract covers. The message names the argument and the accepted range."""


class StrictModeError(RuntimeError):
    """Strict mode refused a path that does not carry the contract."""


class BackendUnavailableError(RuntimeError):
    """A named backend cannot run here; the message says why."""


class FingerprintMismatchError(RuntimeError):
    """Two lm_head weight fingerprints that must agree do not."""
