"""``python -m shardload`` runs the CLI (what ``torchrun -m shardload`` needs)."""

from .cli import main

if __name__ == "__main__":
    main()
