"""The core: the job's description, data, models, results and the registry every layer reads.

Nothing here imports another dtlab subpackage.
"""
