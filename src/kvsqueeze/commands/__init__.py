"""One module per CLI sub-command: ``add_arguments(parser)`` and ``run(args) -> int``.

Modules here must keep their heavy imports (torch, transformers) inside ``run`` so that building the
argument parser stays cheap.
"""
