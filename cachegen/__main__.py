import sys

from cachegen.cli import main

sys.exit(main())
