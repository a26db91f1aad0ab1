"""cilia-cni: the CNI plugin binary of Cilia.

Exec'd by the container runtime once per pod operation (CNI spec 1.0.0/1.1.0); it
validates the invocation and forwards it to the node agent over the
``cilia.agent.v1`` gRPC contract on a unix socket. Its import graph is kept to the
standard library (json/os/sys) plus, only when the agent is contacted, its own HTTP/2
gRPC client (:mod:`cilia_cni.h2grpc`: hpack, hyperframe) and the messages in
:mod:`cilia_cni.wire` (protobuf's wire form, without the protobuf runtime: only an agent
error with details imports ``google.rpc``); not grpcio: start-up is on every pod's
critical path.
"""
