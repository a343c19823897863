import sys

from symbackprop.cli import main

sys.exit(main())
