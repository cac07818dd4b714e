"""Discovery providers shipped with kvroute serve (dns, file, kubernetes), registered in kvroute_server.commands."""
