from cbcert.cli import main

main()
