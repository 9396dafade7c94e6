"""What both offload modes use: argument checks, DTensor helpers, the end of backward, wrapping. Internal: no public names."""
