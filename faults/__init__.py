"""The injectors that apply one fault spec to both modes (the typed specs themselves, and the
functions the runtime evaluates, are :mod:`impl.common.fault_model`)."""
