"""The way back to the client: engine outputs multiplexed per router (the replica side
output_channels.py and output_channel.py, the router side output_demux.py, the socket a
subscription travels on channel_server.py and socket_subscription.py), text and stop
strings applied at the router (text_stream.py), and the fan-in of a request's `n` choices
(stream_merge.py)."""
