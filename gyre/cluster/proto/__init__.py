"""Generated from schemas/gyre.proto by `python -m gyre.cluster.codegen`; never edited by hand."""
