from kvroute.cli import main

main()
