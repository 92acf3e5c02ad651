"""Link-delay injection (defined in :mod:`impl.common.fault_model.link_delay`, which the real runtime reads too)."""
from impl.common.fault_model.link_delay import (  # noqa: F401  (re-exported: the systems' import)
    Link, check_links, link_delays_at, resolve_link, validate_link_delay)
