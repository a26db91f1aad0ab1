module cilia.test/tools/kube/testpod

go 1.26.0
