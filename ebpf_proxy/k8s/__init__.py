"""Everything that talks to the API server: connecting (client.py), list+watch (watch.py), and
turning API objects into model values (convert.py). resources.py lists the calls it may make."""
