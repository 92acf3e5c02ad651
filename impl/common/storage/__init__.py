"""How checkpoint bytes move: a counted local store and an emulated NAS wrapper, shared by our
checkpoint format and torch DCP (STYLE: planner apart from storage)."""
