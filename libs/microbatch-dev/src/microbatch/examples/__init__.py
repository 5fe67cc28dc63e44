"""Example pipelines shipped with microbatch (the demo runs :mod:`.clickstream`)."""
