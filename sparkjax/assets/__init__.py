"""Data shipped inside the package: ``demo/``, the trained demo pair (see ``demo/MODEL_CARD.md``)."""
