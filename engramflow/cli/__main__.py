import sys

from engramflow.cli.app import main

sys.exit(main())
