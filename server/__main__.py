"""`python -m server serve ...` == `pagedserve serve ...`."""
import sys

from server.cli import main

sys.exit(main())
